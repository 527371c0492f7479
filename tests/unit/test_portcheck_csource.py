"""port-check's mirrors of C++ functions: ``# mirrors: csrc/<file>::<function>``."""

from kiln.portcheck.csource import function_text

SOURCE = """\
#include "x.h"
namespace ns {
// a declaration first, then a call: neither is the definition
void scale(torch::Tensor& out, const double f);
static int helper() { return scale_count(1); }

void scale(torch::Tensor& out,  // the output
           const double f) {
  /* doubles
     every element */
  for (int i = 0; i < n; ++i) { out[i] *= f; }
}
}  // namespace ns
"""


def _tree(tmp_path, text):
    (tmp_path / "csrc" / "cpu").mkdir(parents=True)
    (tmp_path / "csrc" / "cpu" / "k.cpp").write_text(text)
    return tmp_path


def test_the_definition_is_found_past_its_declaration_without_comments(tmp_path):
    got = function_text(_tree(tmp_path, SOURCE), "csrc/cpu/k.cpp::scale")
    assert got == ("void scale(torch::Tensor& out, const double f) { for (int i = 0; i < n; "
                   "++i) { out[i] *= f; } }")


def test_a_comment_change_is_no_change_and_a_code_change_is(tmp_path):
    old = function_text(_tree(tmp_path / "a", SOURCE), "csrc/cpu/k.cpp::scale")
    recommented = SOURCE.replace("// the output", "// where it goes")
    assert function_text(_tree(tmp_path / "b", recommented), "csrc/cpu/k.cpp::scale") == old
    changed = SOURCE.replace("*= f", "+= f")
    assert function_text(_tree(tmp_path / "c", changed), "csrc/cpu/k.cpp::scale") != old


def test_a_missing_file_or_function_is_none(tmp_path):
    root = _tree(tmp_path, SOURCE)
    assert function_text(root, "csrc/cpu/k.cpp::nothing") is None
    assert function_text(root, "csrc/cpu/gone.cpp::scale") is None
