"""One rank's cache as pure functions of pytrees: config, logical ids, vTLB, PB-LRU, state, the decode layer
and page selection (select/). No mesh, no jit, no driver: runtime/ builds programs over these."""
