"""Every use of a private name of a dependency, one module per dependency (``lightning``, ``torch``, ``torchdata``),
one small function per use, each saying which public API is missing.  Each module imports only the dependency it
wraps; nothing else in mptrain touches those names (``tests/test_compat_boundary.py`` checks it)."""
