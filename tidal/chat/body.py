"""Request bodies: wrong types are errors, unknown fields are ignored with a logged warning."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict

log = logging.getLogger("tidal.server")  # the server's logger: the warnings are about its requests

_warned: set[tuple[str, str]] = set()


class Body(BaseModel):
    """A request body: wrong types are errors; unknown fields are ignored with a logged warning
    (once per route and field), as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="allow", strict=True)

    def warn_unknown(self, route: str) -> None:
        """Log each unknown field of this body, the first time `route` gets it."""
        for name in self.model_extra or {}:
            if (route, name) not in _warned:
                _warned.add((route, name))
                log.warning("%s: ignoring unknown field %r", route, name)
