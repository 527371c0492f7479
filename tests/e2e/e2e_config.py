"""Settings the shared server starts with and the tests assert against."""

API_KEY = "e2e-test-key"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 4096
# The stall sentinel's threshold on the test server, in seconds.
STALL_WARN_S = 2
# Prefill chunk (--max-num-batched-tokens): a longer prompt prefills in steps.
PREFILL_CHUNK = 256
