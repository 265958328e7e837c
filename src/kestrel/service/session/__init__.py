"""The session layer every protocol shares: status checks, open reads, auto-abort, limits, stats.

Protocol handlers parse a request, call a `Session`, and encode its answer; the rules live here once.
"""
