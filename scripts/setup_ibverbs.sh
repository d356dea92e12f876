#!/usr/bin/env bash
# The Mooncake wheel (the replay's `mooncake` system) loads libibverbs.so.1 at import without
# declaring it, and the PeerCache wheel (serve_bench's `peercache`) links libibverbs.so.1 and
# librdmacm.so.1. Install Debian's libibverbs1 and librdmacm1 where they are missing and we are
# root; otherwise say which systems will be skipped. Never fails the set-up.
set -u
missing=()
/sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || missing+=(libibverbs1)
/sbin/ldconfig -p 2>/dev/null | grep -q 'librdmacm\.so\.1 ' || missing+=(librdmacm1)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian's ${missing[*]} (needed by the Mooncake and PeerCache wheels)"
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || \
        { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; } || \
        echo "warning: apt-get could not install ${missing[*]}: the replay and serve_bench skip mooncake / peercache"
else
    echo "note: ${missing[*]} missing and cannot be installed here (needs root and apt-get):" \
         "the replay and serve_bench skip mooncake / peercache"
fi
exit 0
