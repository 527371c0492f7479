"""What the fork's tests run on, beyond the wheel: the cached CPU test virtualenv, the
peer suite (upstream's own CPU tests against the installed fork), the offline GPU test
bundle with its lock and the steps it runs on the GPU machine, and the tiny
deterministic models (``tinymodel``) the serving tests load.
"""
