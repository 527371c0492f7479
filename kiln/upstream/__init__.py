"""The pinned pristine upstream: ``requirements/upstream.lock`` (which wheel and sdist
each pinned vLLM release means, by sha256), fetching those files into kiln's cache and
re-checking them on every use, the sdist unpacked once and checked against its manifest
(``PristineTree``), and pin-bump, which adds a release to the lock and moves the fork's
pins with upstream's. Everything else in kiln reads upstream through here.
"""
