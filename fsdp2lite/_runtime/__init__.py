"""The sharding runtime: private; users reach it through ``fsdp2lite.fully_shard``."""
