// libFuzzer target: the store server's message parsing (detail::StoreProtocol,
// Note [Store protocol]) on bytes from two clients. The input is cut into
// chunks, each sent by client A or B (the first byte of a chunk picks the
// client and the chunk's length), so messages arrive split anywhere and
// interleaved. Invariants: no crash or sanitizer report; a connection the
// server closes receives nothing more; replies begin with a known status byte.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <ptrain/dist/store_server.hpp>

namespace {

using namespace ptrain::dist;

std::string hello(std::string_view token) {
  std::string m = "PTRS";
  m.push_back(static_cast<char>(detail::kStoreVersion));
  detail::put_str(m, token);
  detail::put_str(m, "job");
  detail::put_i64(m, 0);
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  detail::StoreProtocol store("token", "job");
  struct Client {
    std::uint64_t id;
    bool open = true;
  } clients[2] = {{store.open("a:1")}, {store.open("b:2")}};
  // Client B starts authenticated half the time, so commands are reached without guessing the hello.
  if (size > 0 && (data[0] & 1)) store.receive(clients[1].id, hello("token"));
  std::size_t pos = size > 0 ? 1 : 0;
  while (pos < size) {
    const std::uint8_t ctl = data[pos++];
    Client& c = clients[ctl & 1];
    const std::size_t n = std::min<std::size_t>(size - pos, (ctl >> 1) + 1);
    const std::string_view bytes(reinterpret_cast<const char*>(data) + pos, n);
    pos += n;
    if (!c.open) continue;
    if (!store.receive(c.id, bytes)) {
      store.close(c.id);
      c.open = false;
      continue;
    }
    const std::string out = store.take_output(c.id);
    if (!out.empty() && static_cast<std::uint8_t>(out[0]) > 2) std::abort();  // status 0, 1 or 2
    if (store.closing(c.id)) {
      store.close(c.id);
      c.open = false;
    }
  }
  return 0;
}
