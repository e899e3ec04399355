"""Fleet scheduling: which job runs next (``policy``), in plain Python; its atomic Redis side lives in store/."""
