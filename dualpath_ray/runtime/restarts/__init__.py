"""Actor restarts: incarnations, how a silent peer is classified, rejoining the transport, and the state a
front-end actor finds again after Ray restarts it. The bottom of runtime/: every actor restarts.
"""
