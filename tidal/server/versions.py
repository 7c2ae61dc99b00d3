"""Weight versions as the update routes take them (`/update_weights_from_tensor`, `_disk` and
`_distributed`): an int >= 0 (SGLang's clients send it as a string of digits, so one is taken
too), or null to keep the version the engine holds; and never older than that version, unless
the body says `allow_older: true`.

Why: the engine reports -1 for "no weights" (woken from sleep, nothing loaded since) and refuses
to generate then, so a negative version would stop generation while `/health` says ok; and a
version that goes back (10, then 3) is a push from a trainer that does not know what the engine
holds, which would tag new samples with an old version. A trainer that restarted (or resumed
from a checkpoint behind a server that lived on) knows it goes back, and says so with
`allow_older` (tidal's field, sent on its first push only; SGLang's servers ignore it).
"""

from __future__ import annotations

from tidal.adapters.async_engine import VersionCheck
from tidal.chat.errors import BadRequest


def weight_version(value: int | str | None) -> int | None:
    """The version an update body names (None: keep the one held); BadRequest naming
    `weight_version` unless it is an int >= 0."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise BadRequest(f"weight_version: must be an int >= 0, got {value!r}") from None
    if value < 0:
        raise BadRequest(f"weight_version: must be an int >= 0, got {value}")
    return value


def not_older(version: int | None, allow_older: bool) -> VersionCheck:
    """The check an update to `version` runs on the engine thread just before it loads (so no
    other update comes between): BadRequest naming the value and the version held when it would
    go back and the body did not say `allow_older`."""

    def check(held: int) -> None:
        if version is not None and version < held and not allow_older:
            raise BadRequest(
                f"weight_version: {version} is older than the weights this engine holds (version {held}); a "
                "trainer that restarted sends allow_older: true to go back"
            )

    return check
