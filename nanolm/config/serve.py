"""`nanolm serve`'s settings (`ServeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanolm.config.fields import check as _check
from nanolm.config.sampling import is_int, is_number


@dataclass
class ServeConfig:
    """`nanolm serve`'s settings: where it listens, who may use it, its name, and what one request may cost.

    It listens on loopback unless `host` says otherwise. At most `max_queue` requests are admitted at once
    (the next gets 429) and at most `max_batch` rows of them decode together; a body over `max_body_bytes`
    gets 413 unread, and one that does not arrive within `body_timeout_s` of its headers gets 408; a connection
    that has not sent a request's headers within `header_timeout_s` is closed, and at most `max_connections`
    are open at once. The `nanolm serve` options are generated from these fields.
    """

    host: str = field(default="127.0.0.1", metadata={"help": "listen address; 0.0.0.0 for every interface"})
    port: int = field(default=8000, metadata={"help": "0 picks a free port"})
    api_key: str | None = field(default=None, repr=False,
                                metadata={"help": "require `Authorization: Bearer KEY` (or set NANOLM_API_KEY)"})
    model_name: str = field(default="", metadata={"help": "the name clients see; \"\" = the run directory's name"})
    max_queue: int = field(default=64,
                           metadata={"help": "requests admitted at once (running or waiting); more get 429"})
    # Decoding reads every weight once per step whatever the rows, so rows decoded together cost little more
    # than one, up to where the products become bound by arithmetic: about 16 rows of a small model on a CPU.
    max_batch: int | None = field(default=None, metadata={
        "help": "rows (choices of requests) decoded together; the rest wait; default 16 on a CPU, 64 on a GPU"})
    # A whole context of text, JSON-escaped, is far less than 1 MiB for nanolm's models.
    max_body_bytes: int = field(default=1 << 20,
                                metadata={"help": "largest request body; a larger one gets 413 unread"})
    # A client that stops sending gets 408 instead of holding its connection open for good.
    body_timeout_s: float = field(default=30.0, metadata={
        "flag": "--body-timeout", "help": "seconds a request body may take to arrive after its headers; then 408"})
    # A connection that never finishes its request's headers (a half-open or idle socket) is closed after
    # this; uvicorn's own keep-alive time-out starts only after a first response.
    header_timeout_s: float = field(default=10.0, metadata={
        "flag": "--header-timeout", "help": "seconds a connection may take to send a request's headers; then closed"})
    max_connections: int = field(default=256, metadata={
        "help": "open connections at once; one more is closed at once"})
    guide_calls: bool = field(default=True, metadata={
        "help": "once the model opens a tool call, hold what it writes to the offered tools' schemas"})
    # Decoding is bound by reading the weights, which one core nearly saturates, while the HTTP side (parsing,
    # tokenizing, streaming) needs a core of its own: on 2 cores, 16 requests of `tiny` together ran 4.8x one
    # alone with 1 decoding thread and 3.3x with 2 (bench/server_load.py --scaling); minimind-26m decodes a
    # token in 11.3 ms on 1 thread and 11.1 ms on 2.
    threads: int = field(default=0, metadata={
        "help": "CPU threads that decode; 0 = one fewer than the CPU's cores (at least 1, at most torch's own "
                "default)"})
    # The decode step under torch.compile runs fewer, fused operations: on a 2-core AVX2 EPYC a step of `tiny`'s 16
    # rows plus one of 1 row took 6.3-7.8 against 10.3-11.7 ms, after 39-48 s of compiling at start-up, while an
    # AVX-512 EPYC measured no gain (bench/RESULTS.md). So it is asked for, and kept only where it measures faster.
    compile: bool = field(default=False, metadata={
        "help": "torch.compile the decode step at start-up (tens of seconds on a CPU; needs a C++ compiler) and "
                "keep it where it measures faster"})

    @property
    def loopback(self) -> bool:
        """Whether it listens on loopback only (then a page cannot reach it but through a loopback name)."""
        return self.host in ("127.0.0.1", "localhost", "::1")

    def __post_init__(self) -> None:
        _check(isinstance(self.host, str) and bool(self.host.strip()),
               f"host={self.host!r}: must be a host name or address, such as 127.0.0.1 (loopback only)")
        _check(is_int(self.port) and 0 <= self.port <= 65535,
               f"--port {self.port!r}: must be an integer from 0 to 65535 (0 picks a free port)")
        _check(self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)),
               "api_key: must be a non-empty string, or None for a server without a key")
        _check(isinstance(self.model_name, str), f"model_name={self.model_name!r}: must be a string")
        _check(is_int(self.max_queue) and self.max_queue >= 1,
               f"max_queue={self.max_queue!r}: must be an integer >= 1 (requests admitted at once)")
        _check(self.max_batch is None or (is_int(self.max_batch) and self.max_batch >= 1),
               f"max_batch={self.max_batch!r}: must be an integer >= 1 (rows decoded together), or unset")
        _check(is_int(self.threads) and self.threads >= 0,
               f"threads={self.threads!r}: must be an integer >= 0 (0 = one fewer than the CPU's cores)")
        _check(is_int(self.max_body_bytes) and self.max_body_bytes >= 1,
               f"max_body_bytes={self.max_body_bytes!r}: must be an integer >= 1 (the largest request body)")
        _check(isinstance(self.guide_calls, bool), f"guide_calls={self.guide_calls!r}: must be true or false")
        _check(isinstance(self.compile, bool), f"compile={self.compile!r}: must be true or false")
        _check(is_number(self.body_timeout_s) and self.body_timeout_s > 0,
               f"body_timeout_s={self.body_timeout_s!r}: must be a number of seconds > 0")
        _check(is_number(self.header_timeout_s) and self.header_timeout_s > 0,
               f"header_timeout_s={self.header_timeout_s!r}: must be a number of seconds > 0")
        _check(is_int(self.max_connections) and self.max_connections >= 1,
               f"max_connections={self.max_connections!r}: must be an integer >= 1 (open connections at once)")

