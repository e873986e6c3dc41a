"""Model weight versions across the cluster: the ledger of published versions and the broadcast group a
trainer syncs weights through. Below engines (which load them) and control (which publishes them).
"""
