"""The user's walk end to end: the operator, the router and real serving pods."""
