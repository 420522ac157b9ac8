"""`devharness bundle --url URL [--out DIR]`: a bundle written by a running server (diagnostics/bundle.py's
BundleWriter, through `POST /debug/bundle`), and fetched from it."""
from __future__ import annotations

from pathlib import Path

import msgspec

from devharness.protocol.json_codecs import bundle_written_decoder


def bundle_main(args) -> int:
    """`devharness bundle --url URL [--out DIR] [--token T]`: ask a `serve --debug` server for a bundle; with
    --out, fetch it too (the server may be on another machine); --token is the server's debug token."""
    import io
    import tarfile

    import httpx
    url = args.url.rstrip("/")
    token = getattr(args, "token", None)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.post(f"{url}/debug/bundle", timeout=120, headers=auth)
        if r.status_code == 401:
            raise ValueError(f"{url} needs its debug token: pass --token T or set DEVHARNESS_DEBUG_TOKEN")
        if r.status_code == 404:   # POST /debug/bundle is there on every `serve --debug`
            raise ValueError(f"{url} has no /debug routes: start the server with --debug")
        if r.status_code != 200:
            raise ValueError(f"{url}/debug/bundle answered {r.status_code}: {r.text[:200]}")
        made = bundle_written_decoder.decode(r.content)
        print(f"bundle written on the server: {made.path}")
        if args.out:
            t = httpx.get(f"{url}/debug/bundle/{made.name}", timeout=120, headers=auth)
            t.raise_for_status()
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(t.content), mode="r:gz") as tar:
                tar.extractall(out, filter="data")
            print(f"fetched to {out / made.name}")
    except httpx.HTTPError as e:
        raise ValueError(f"{url}: {type(e).__name__}: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"{url}: not a devharness debug server ({e})") from None
    return 0
