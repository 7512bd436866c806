"""Checkpoint tiers: where a step's parts are kept and how they move between places.

One package so the import contracts can name it whole: the parts and their protocol, the part
stores (local, peer, fsspec), replication to peers, the persistent and memory tiers, the background
loop and manifest watch they share, and restart selection across tiers (``selection``, ``resume``).
Nothing here is imported on import of the package; import the module you need.
"""
