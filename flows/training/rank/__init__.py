"""The rank: what runs in one DDP rank, a process (`rank_main`, a standby until
handed its order) or a Ray actor (`ray_actor`), where the user's code runs.
Its `Worker` (`rank`), what it builds the same way every segment
(`rank_setup`), the user's task (`task`), which samples each rank trains on
(`sampler`), rank 0's checkpoint saves (`saving`) and what tells it to stop
(`stop_flags`).

It may import the shared modules at the top of `flows.training` (what the
coordinator tells it and reads back: `segment`, `orders`, `regroup`,
`supervision`, `control`; the registries) and `launch` (through its order's
`identity`), never the coordinator or `reporting`. Only processes that run
a user's code import it (the ranks, the take-in check's process); the
coordinator names its Ray actor class, `launch` its process entry.
"""
