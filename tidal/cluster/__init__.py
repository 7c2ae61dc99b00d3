"""Where the roles run: in this process (the laptop default), or on Ray (trainer ranks with FSDP2,
engine actors, colocated or not). `roles.build_roles` builds them from the config; `options` is
the cluster group."""
