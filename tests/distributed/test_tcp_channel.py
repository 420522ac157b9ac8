"""The TCP control channel on loopback: frames are protocol's length prefix and msgpack (frames.LENGTH, the one
encoder), a worker joins with its rank and the executor's token, and a stranger's connection is dropped."""
import socket

from devharness.distributed.tcp_channel import TcpDriverChannel, TcpWorkerChannel
from devharness.protocol.frames import LENGTH, Hello, encode, hello_decoder


def test_a_worker_joins_and_frames_cross_both_ways():
    driver = TcpDriverChannel.listen("127.0.0.1", b"secret", send_timeout_s=5.0)
    stranger = socket.create_connection(driver.address)
    body = encode(Hello(0, b"wrong"))
    stranger.sendall(LENGTH.pack(len(body)) + body)
    worker = TcpWorkerChannel.connect(driver.address, rank=0, token=b"secret")
    try:
        driver.accept({0}, timeout_s=10.0)
        assert list(driver.peers) == [0]
        assert stranger.recv(1) == b""    # dropped: the wrong token
        driver.broadcast(b"step one")
        assert worker.read(5.0) == b"step one"
        big = bytes(range(256)) * 1024    # over the single-write size: header and body sent apart
        worker.write(big)
        assert driver.read_from(0, 5.0) == big
        assert worker.read(0.05) is None
    finally:
        stranger.close()
        worker.close()
        driver.close()


def test_the_hello_is_a_length_prefixed_msgpack_frame():
    """What a worker's first frame is on the socket, byte for byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    worker = TcpWorkerChannel.connect(listener.getsockname()[:2], rank=3, token=b"t0k")
    conn, _ = listener.accept()
    try:
        conn.settimeout(5.0)
        data = b""
        while len(data) < LENGTH.size or len(data) < LENGTH.size + LENGTH.unpack_from(data)[0]:
            data += conn.recv(4096)
        (n,) = LENGTH.unpack_from(data)
        assert data[:LENGTH.size] == n.to_bytes(4, "big")
        assert hello_decoder.decode(data[LENGTH.size:LENGTH.size + n]) == Hello(3, b"t0k")
    finally:
        conn.close()
        worker.close()
        listener.close()
