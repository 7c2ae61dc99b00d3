"""Ray for trainer ranks and engines: placement groups (`ray_setup`), FSDP2 trainer ranks
(`trainers`, `ranks`), engine actors behind tidal's HTTP server (`engines`); the cluster group's
options (`options`). `tidal.roles` builds them from the config."""
