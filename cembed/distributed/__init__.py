"""Several processes: the process group, the collectives (rank agreement), the launcher, what a rank does when a peer
fails or hangs, and one module per strategy (DDP's unused-parameter handling, FSDP).

May import: ``cembed.errors`` only (torch lazily).
"""
