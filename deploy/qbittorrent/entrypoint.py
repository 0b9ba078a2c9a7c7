"""qbittorrent-nox in a container, configured from the environment at every start.

The config is written by the same code the tests and the demo use (`proj/qbt/local.py`, stdlib
only, copied into the image as `qbt_local.py`), with the container's differences on top: the Web
UI on every interface at 8080 behind a username and password (`QBT_USERNAME`, `QBT_PASSWORD`),
peers on 6881, the save path `/downloads`, and the on-finish hook `on-finished %K`, which POSTs
to the engine's `/api/hooks/qbittorrent` with `HOOK_TOKEN` (`PROJ_HOOK_URL` says where).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from qbt_local import LocalQbittorrent, supports_confirm_legal_notice

PROFILE = Path(os.environ.get("QBT_PROFILE", "/config"))
HOOK = 'sh -c "/usr/local/bin/on-finished %K >> /config/hook.log 2>&1"'


def main() -> None:
    user, password = os.environ.get("QBT_USERNAME", "admin"), os.environ.get("QBT_PASSWORD")
    if not password:
        sys.exit("qbittorrent: set QBT_PASSWORD (the Web UI password the workers log in with)")
    on_finished = os.environ.get("QBT_ON_FINISHED", HOOK if os.environ.get("HOOK_TOKEN") else "")
    qbt = LocalQbittorrent(
        PROFILE,
        save_path=Path(os.environ.get("QBT_SAVE_PATH", "/downloads")),
        on_finished=on_finished or None,
        username=user,
        password=password,
        webui_port=8080,
        listen_port=int(os.environ.get("QBT_LISTEN_PORT", "6881")),
        extra_config={
            "Preferences": {
                "WebUI/Address": "*",
                # Other containers reach it by service name, and scripts post without a page.
                "WebUI/HostHeaderValidation": False,
                "WebUI/CSRFProtection": False,
            },
            "BitTorrent": {"Session/InterfaceAddress": ""},
        },
        name="container",
    )
    qbt.write_config()
    binary = "qbittorrent-nox"
    args = [binary, f"--profile={PROFILE}"]
    if supports_confirm_legal_notice(binary):
        args.append("--confirm-legal-notice")
    print(f"qbittorrent: Web UI :8080 as {user!r}, peers :{qbt.listen_port}, save path {qbt.save_path}")
    print(f"qbittorrent: on-finish hook {'set' if on_finished else 'not set (no HOOK_TOKEN)'}", flush=True)
    os.execvp(binary, args)


if __name__ == "__main__":
    main()
