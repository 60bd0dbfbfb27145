"""The controller: the pure decision core and its queue, victims, placement and reaper, its async
edge (admission), its effects, the memory budget and the engines' measured footprint, the
start history."""
