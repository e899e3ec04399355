"""One model replica over several processes: pipeline stages x tensor-parallel shards."""
