"""The controller in the loop: the adapter at step boundaries, its prices and calibration, the device pool, and
the one device-loss policy."""
