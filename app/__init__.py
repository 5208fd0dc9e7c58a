"""The composition root: the context every plugin receives, the Tornado application and
its serve lifecycle, logging, and the command line. It wires every layer together and is
imported by none of them; receiver.py is its entry point."""

# This release's number, as CHANGELOG.md's latest heading gives it (tests/test_cli.py).
VERSION = "0.9.0"
