"""The embedded broker: kombu's filesystem transport with atomic message writes.

kombu's own ``_put`` creates the message file and then writes it, so a worker polling the
folder can pick up the file while it is still empty and die on the JSON error. Here each
message is written under a name no reader matches and renamed into place when complete.
"""
from __future__ import annotations

import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs) -> None:
        """Put a message on ``queue``: write it whole, then rename it into the folder."""
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.partial")
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)  # atomic on one filesystem: readers see all or nothing
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
