"""The wheels kiln builds: the fork's ``vllm`` wheel (the pristine upstream wheel
repacked with the series, the overlay and the fork's compiled csrc/ and KVarN CUDA
library), its version from git tags, its .dist-info with the fork's pins and NOTICE,
and the fork's xgrammar wheels (the pinned sdist plus ``patches/xgrammar/``, built per
Python and tagged manylinux).
"""
