"""One module per ``python -m kiln`` subcommand (see kiln.cli)."""
