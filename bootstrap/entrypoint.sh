#!/bin/sh
# The container's command: the bootstrap node, announcing $PUBLIC_IP. Inside a container the node
# sees only its bridge address, which no peer outside can dial, so PUBLIC_IP is required.
# Extra arguments (docker run IMAGE ARGS, compose's command:) are appended.
set -eu
if [ -z "${PUBLIC_IP:-}" ]; then
    echo "error: PUBLIC_IP is not set; pass this host's public IP address (docker run -e PUBLIC_IP=203.0.113.7)" >&2
    exit 2
fi
exec p2p-diloco bootstrap --identity /data/bootstrap.key --host 0.0.0.0 --port 31337 --announce "$PUBLIC_IP" \
    --observe-host 0.0.0.0 --observe-port 8080 --config /config/run.toml "$@"
