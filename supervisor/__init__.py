"""rlsup: the per-node supervisor (``rlsup run``, ``rlsup daemon``) and its command line."""

__version__ = "0.1.0"
