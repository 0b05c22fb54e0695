"""A TLS front for the benchmark's loopback S3 endpoint, for clients that refuse plain HTTP.

litdata reads object storage through obstore, which refuses an ``http://`` endpoint ("builder error":
no ``allow_http`` reaches it from litdata's options), so against a plain-HTTP test server it cannot
read at all. :class:`TlsFront` accepts TLS on 127.0.0.1 with a certificate of a throwaway CA made
here (``openssl``) and forwards the decrypted bytes to the plain endpoint (the benchmark's fault
proxy, which adds the round trip and counts the bytes, then the server). A client trusts the CA
through the environment: ``SSL_CERT_FILE`` (obstore's rustls with native roots) and
``AWS_CA_BUNDLE`` (boto3). One asyncio loop in one thread does all TLS work (an ``SSLSocket`` must
not be read and written from two threads at once).
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import ssl
import subprocess
import threading
from pathlib import Path

__all__ = ["TlsFront", "make_ca"]


def make_ca(folder: Path) -> tuple[Path, Path, Path] | None:
    """A CA certificate and a server certificate and key for IP 127.0.0.1, in ``folder``; None
    without an ``openssl`` binary."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    ca, ca_key, key, csr, cert, ext = (folder / n for n in ("ca.pem", "ca.key", "srv.key", "srv.csr", "srv.pem", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")

    def run(command: str, **paths: Path) -> None:
        quoted = {name: shlex.quote(str(path)) for name, path in paths.items()}
        subprocess.run([openssl, *shlex.split(command.format(**quoted))], check=True, capture_output=True)

    run(
        "req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=bench-ca -keyout {key} -out {ca} "
        "-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign",
        key=ca_key,
        ca=ca,
    )
    run("req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout {key} -out {csr}", key=key, csr=csr)
    run(
        "x509 -req -days 2 -CAcreateserial -in {csr} -CA {ca} -CAkey {ca_key} -out {cert} -extfile {ext}",
        csr=csr,
        ca=ca,
        ca_key=ca_key,
        cert=cert,
        ext=ext,
    )
    return ca, cert, key


class TlsFront:
    """Accepts TLS on 127.0.0.1 and forwards each connection to ``upstream`` (host, port) in plain TCP."""

    def __init__(self, upstream: tuple[str, int], cert: Path, key: Path) -> None:
        self.upstream = upstream
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(str(cert), str(key))
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self.port = 0

        async def serve() -> None:
            server = await asyncio.start_server(self._forward, "127.0.0.1", 0, ssl=self._context)
            self.port = server.sockets[0].getsockname()[1]
            started.set()
            async with server:
                await server.serve_forever()

        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(serve(),), daemon=True)
        self._thread.start()
        started.wait(10)

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def _forward(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while chunk := await reader.read(65536):
                    writer.write(chunk)
                    await writer.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
