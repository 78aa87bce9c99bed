#!/usr/bin/env bash
# Prometheus and promtool for the demo and the tests, from Debian's `prometheus` package,
# unpacked into a private directory: no service is installed, started or changed, and nothing
# outside $DEST is written. The demo starts its own Prometheus (a private data dir, removed on
# exit); the tests run `promtool check metrics`, `promtool test rules` and a Prometheus of their own.
# Idempotent: does nothing when the binaries are there. Prints the bin directory.
set -euo pipefail
VERSION=2.42.0
DEST=${LINKPASS_PROMETHEUS_DIR:-/var/cache/linkpass/prometheus/$VERSION}
if [[ -x $DEST/bin/prometheus && -x $DEST/bin/promtool ]]; then
    echo "$DEST/bin"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "Prometheus $VERSION is not in $DEST/bin; run this as root once (it only unpacks Debian's package there)" >&2
    exit 1
fi
echo "unpacking Prometheus $VERSION (Debian package, ~19 MB) into $DEST" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt's download user writes here
(cd "$work" && apt-get download -q "prometheus=$VERSION*" >/dev/null 2>&1) || {
    apt-get update -qq && (cd "$work" && apt-get download -q "prometheus=$VERSION*" >/dev/null)
}
dpkg-deb -x "$work"/prometheus_*.deb "$work/x"
mkdir -p "$DEST/bin.new"
install -m 755 "$work/x/usr/bin/prometheus" "$work/x/usr/bin/promtool" "$DEST/bin.new/"
rm -rf "$DEST/bin" && mv "$DEST/bin.new" "$DEST/bin"
"$DEST/bin/promtool" --version >/dev/null
echo "$DEST/bin"
