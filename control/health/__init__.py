"""The leader's view of node health (docs/design.md, Health).

* ``node_states`` - the node state table and the pure decisions (no I/O, no clock);
* ``monitor`` - the shell: heartbeats in, node state changes out;
* ``recovery`` - ending the gangs of failed nodes, evicting drained ones;
* ``burn_in`` (+ ``burn_in_check``, the test a node runs) - returning nodes to service;
* ``reconcile`` - agents' reports against the store's leases;
* ``metrics`` - what it exports to Prometheus.

It runs only while its process leads and reads the leader's state (``control.leader``).
"""
