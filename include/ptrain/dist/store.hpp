#pragma once
// The key-value rendezvous store: includes every part, so that
// `#include "ptrain/dist/store.hpp"` brings the Store interface and TCPStore.
//
//   store_interface.hpp   Store (abstract), its limits, barrier()
//   store_protocol.hpp    wire format shared by client and server  (Note [Store protocol])
//   store_server.hpp      detail::StoreServer, served by rank 0     (Note [Server shutdown])
//   tcp_store.hpp         TCPStore (the client) and make_store()    (Note [Waits])

#include "ptrain/dist/store_interface.hpp"
#include "ptrain/dist/store_protocol.hpp"
#include "ptrain/dist/store_server.hpp"
#include "ptrain/dist/tcp_store.hpp"
