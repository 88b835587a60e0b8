"""Version-guarded workarounds for upstream behaviour, one module per upstream issue.

Each module says what it works around, links the upstream code or issue, checks the
version it applies to, and has a test. None of them replaces upstream code.
"""
