"""HTTP as bytes on a socket, for what an HTTP client library will not send: header
bytes that are not latin-1 text, a body held back, a chunked body that does not stop."""
import socket


def exchange(port, head, body_pieces=(), timeout=10):
    """Send `head`, then the body's pieces until the service answers; returns the answer
    (its first bytes). As a client that reads while it sends (curl does), so an early
    answer is not lost."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for piece in body_pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.setblocking(False)
            try:
                answer = sock.recv(65536)
                if answer:
                    return answer
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        return sock.recv(65536)


def status_of(answer):
    return int(answer.split(b" ", 2)[1])


def port_of(url):
    return int(url.rsplit(":", 1)[1])
