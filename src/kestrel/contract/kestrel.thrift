# Kestrel's RPC contract. Kestrel's own IDL, unchanged on the wire, so any client generated from it
# (Finagle/Scala, Java, Ruby, Go, Python) talks to this server unchanged; plus three calls at the end
# that Kestrel lacks, which its clients never make (a Kestrel server answers them as unknown methods).

namespace java net.lag.kestrel.thrift
namespace rb Kestrel
namespace py kestrel

# An item handed out by `get`. `id` is 0 for a plain read, and otherwise the server-wide id of the
# open read, to pass to `confirm` or `abort`.
struct Item {
  1: binary data
  2: i64 id
}

# An item handed out by `get_timed`: an Item, with when it was added and when it expires
# (milliseconds since the epoch).
struct TimedItem {
  1: binary data
  2: i64 id
  3: i64 add_time_msec
  4: optional i64 expiry_msec  # absent: never expires
}

# What `peek_items` saw: items left where they are, and where the queue stands. Positions count the
# queue's items from when the server opened it: an item keeps its position while it stays in the
# queue (items taken from the head move `head` on; an aborted read put back moves it one back).
struct ItemsAt {
  1: i64 opened_at  # when the server opened the queue (ms since the epoch): positions count from then
  2: i64 head  # the head item's position
  3: i64 items  # the items in the queue (open reads not counted)
  4: i64 after  # the position after the last one the look covered
  5: list<TimedItem> shown  # in queue order, each with id 0; expired items left out
}

# What `peek` reports: the head item (if any) and the queue's figures.
struct QueueInfo {
  1: optional binary head_item
  2: i64 items
  3: i64 bytes
  4: i64 journal_bytes
  5: i64 age
  6: i32 waiters
  7: i32 open_transactions
}

# The server's status. NOT_CONFIGURED means the server keeps no status file.
enum Status {
  NOT_CONFIGURED = 0,
  QUIESCENT = 1,
  READ_ONLY = 2,
  UP = 3
}

service Kestrel {
  # Add items to a queue; returns how many were accepted (fewer when the queue is full).
  # expiration_msec is relative to now; 0 means the items never expire.
  i32 put(1: string queue_name, 2: list<binary> items, 3: i32 expiration_msec = 0)

  # Take up to max_items, waiting up to timeout_msec for them to arrive. With auto_abort_msec > 0
  # each item is an open read that returns to the head of its queue unless confirmed in time.
  list<Item> get(1: string queue_name, 2: i32 max_items, 3: i32 timeout_msec = 0, 4: i32 auto_abort_msec = 0)

  # Close open reads for good; returns how many ids were open.
  i32 confirm(1: string queue_name, 2: set<i64> ids)

  # Put open reads back at the head of their queue; returns how many ids were open.
  i32 abort(1: string queue_name, 2: set<i64> ids)

  # The head item, left in place, and the queue's figures.
  QueueInfo peek(1: string queue_name)

  void flush_queue(1: string queue_name)
  void flush_all_queues()
  void delete_queue(1: string queue_name)

  Status current_status()
  void set_status(1: Status status)
  string get_version()

  # Beyond Kestrel's contract: calls that create no queue, for readers that only look (Spark's).

  # The queues the server holds (fanout readers included, aliases not).
  list<string> queue_names()

  # `get`, with each item's add time and expiry. A queue the server does not hold is not created:
  # the answer is no items, at once.
  list<TimedItem> get_timed(1: string queue_name, 2: i32 max_items, 3: i32 timeout_msec = 0, 4: i32 auto_abort_msec = 0)

  # Up to max_items items from position `first` on (from the head, if that is past it), left where
  # they are: nothing is opened, taken, counted or journaled, so a look is no delivery and moves no
  # item towards max_errors. Only items held in memory are shown: `after` stops where the queue goes
  # on on disk (read-behind). The items stop once their bytes reach 512 KB, as a get's do (one at
  # least): go on from `after`. A queue the server does not hold is not created (every figure 0).
  ItemsAt peek_items(1: string queue_name, 2: i64 first, 3: i32 max_items)
}
