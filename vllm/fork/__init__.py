"""The fork's own modules inside the vllm package (the overlay).

Upstream files reach these through one-line hooks carried as topic patches,
so each patch stays small and rebases cleanly.
"""
