"""The shared limit store's connection (`resp`): Redis on Trio. What the serving path does
with it is `serving.limits`."""
