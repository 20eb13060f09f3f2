"""The multi-host test bed and the fault matrix (docs/reliability.md). A package, so that its
conftest does not shadow tests/conftest.py (the suite imports helpers `from conftest`)."""
