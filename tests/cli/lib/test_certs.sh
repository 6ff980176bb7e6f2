# Sourced by the TLS tests (tls_test.sh, rank_tls_test.sh): throw-away X.509
# material made with openssl in the current directory. The caller defines
# fail() (prints its logs and exits non-zero).
#   mkca NAME                 self-signed CA: NAME.pem, NAME.key
#   mkcert NAME CA EXTLINES   key + certificate signed by CA, extensions from
#                             EXTLINES (x509v3 config lines, e.g. a SAN)
ossl() { openssl "$@" >/dev/null 2>&1 || fail "openssl $*"; }
mkca() {  # name
  ossl req -x509 -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.pem" -days 2 -subj "/CN=$1" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}
mkcert() {  # name ca extfile-lines
  ossl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$1"
  printf '%s\n' "$3" >"$1.ext"
  ossl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -out "$1.pem" -days 2 \
    -extfile "$1.ext"
}
