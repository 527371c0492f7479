"""The topic series and its git view: ``patches/<version>/`` parsed into topics (the
header and the diff of each), applied to the pristine tree at fuzz 0, materialized as a
git repository (pristine tag plus one commit per topic) and exported back byte for byte,
rebased onto a new upstream with every stop recorded, verified end to end, and listed as
the README's topics table. The port check that looks past a clean rebase is its sibling,
``kiln.portcheck``.
"""
