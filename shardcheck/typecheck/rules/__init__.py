"""The typing rules, one module per family of ops; :mod:`registry` builds the one rule table."""
