"""Security tests (issue 9): tokens, secrets, isolation, sessions, headers."""
