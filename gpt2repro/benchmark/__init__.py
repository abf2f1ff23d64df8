"""What only bench.py uses: the peers' trainers, adapted and timed, and a step's time against its floors."""
