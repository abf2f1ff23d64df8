"""What every script shares: devices and dtypes, processes and their group, command lines and config files, reading what users hand in and writing files whole."""
