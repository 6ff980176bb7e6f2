// coordinator/tokenizer/byte_level.h — the GPT-2 byte-to-character table that
// byte-level BPE vocabularies are written in: printable Latin-1 bytes stand for
// themselves, every other byte b maps to U+0100 + (its rank among those).
// So ' ' is 'Ġ' (U+0120) and '\n' is 'Ċ' (U+010A).
//
// Internal to coordinator/tokenizer. Thread-safe (immutable tables).
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_BYTE_LEVEL_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_BYTE_LEVEL_H_

#include <string>
#include <string_view>

namespace exl3serve::coordinator::internal {

// The character byte `b` is written as.
char32_t ByteToChar(unsigned char b);

// The byte character `c` stands for, or -1 if `c` is not in the table.
int CharToByte(char32_t c);

// Every byte of `bytes` replaced by its character, as UTF-8.
std::string BytesToByteLevel(std::string_view bytes);

}  // namespace exl3serve::coordinator::internal

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_BYTE_LEVEL_H_
