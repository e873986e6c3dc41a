"""Where actors run and how their traffic is marked: the node plan, placement groups, KV traffic classes
(QoS). Below every actor, which all read the plan.
"""
