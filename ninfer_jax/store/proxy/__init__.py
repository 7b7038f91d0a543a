"""The proxy: what an engine programs against (StoreScheduler + StoreWorker) and the nodes that
implement it over stores: StoreEntry (one store), StorePipe (tiers), StorePeer (routed branches),
assembled from a dict by StoreAssembler."""
