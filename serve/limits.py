"""How long a client has to send a request: its head (the request line and headers) and its body. `edge-spec serve`
takes both as flags (--head-timeout, --body-timeout); these are their defaults."""

HEAD_TIMEOUT_S = 10.0  # a connection must send a whole request head within this (slow and idle clients are closed)
BODY_TIMEOUT_S = 20.0  # a request body not whole by then is refused (408): a slow sender holds no connection for long
