"""Replay on a device mesh (mesh.py: data x branch x seq under shard_map, FSDP) and the sequence-sharded
prompt (seq_parallel.py). See docs/design.md, "Mesh and sharding"."""
