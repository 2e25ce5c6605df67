"""Which call a handle belongs to.

The host gives each function call its own handle table, released when the
call ends; an object of a `@remote_class` keeps one table from its
constructor to its destruction. A Python object holding a handle remembers
the scope it was made in and releases its handle when it is collected only
while that scope is alive: a handle number of an ended call means nothing
(or something else) in the next one.
"""


class Scope:
    """The handle table of one call, or of one object."""

    # A class attribute, not `__init__`: making a scope is on every call's
    # path, and an `__init__` is a Python frame there.
    alive = True


current = None
"""The scope of the call running now (`None` at import time)."""
