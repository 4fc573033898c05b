"""Command-line tools: thin faces over the library (see each module's docstring)."""
